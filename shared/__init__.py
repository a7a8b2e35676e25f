"""HybridGen: an LLM inference server that uses the CPU and the GPU as partners."""
