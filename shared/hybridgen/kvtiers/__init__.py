"""The KV tiers below Hot: the Warm tier in host shared memory (codecs, pool, attention over it on
either device, spill and swap), Cold, and prefix reuse across them.
"""
