"""Write the B6 prompt files from the sample prompts (bench/prompts.jsonl):

    python bench/make_b6_prompts.py

- bench/prompts_b6.jsonl: 16 long-context requests from 1K to 32K bytes (the synthetic
  presets' byte tokenizer makes that 1K to 32K tokens), log-spaced, each an instruction of
  the sample file over its long documents' paragraphs, cycled until the target is reached;
- bench/prompts_short.jsonl: the many-short-requests case, every sample prompt under 1,000
  characters, twice over (68 requests).

Deterministic: the same sample file writes the same files.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
LONG_COUNT, SHORTEST, LONGEST = 16, 1024, 32768
SHORT_LIMIT = 1000


def main() -> None:
    prompts = [json.loads(line)["prompt"] for line in (HERE / "prompts.jsonl").open()]
    documents = [p.split("\n\n", 1) for p in prompts if len(p) > 2000]  # (instruction, body)
    paragraphs = [para for _, body in documents for para in body.split("\n\n")]
    long = []
    for i in range(LONG_COUNT):
        target = round(SHORTEST * (LONGEST / SHORTEST) ** (i / (LONG_COUNT - 1)))
        instruction = documents[i % len(documents)][0]
        text, j = instruction, i * 7
        while len(text) < target:
            text += "\n\n" + paragraphs[j % len(paragraphs)]
            j += 1
        long.append(text)
    short = [p for p in prompts if len(p) < SHORT_LIMIT] * 2
    for name, texts in (("prompts_b6.jsonl", long), ("prompts_short.jsonl", short)):
        with (HERE / name).open("w") as f:
            for t in texts:
                f.write(json.dumps({"prompt": t}) + "\n")
        sizes = sorted(len(t.encode()) for t in texts)
        print(f"{name}: {len(texts)} prompts, {sizes[0]} to {sizes[-1]} bytes")


if __name__ == "__main__":
    main()
