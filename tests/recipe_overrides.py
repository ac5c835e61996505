"""Overrides for tests that run the default recipe: its TLT machinery off.

The default recipe speculates (adaptive) and trains the drafter on idle workers. The drafter's
training depends on idle time, so runs compared step for step (resume, launchers) use plain
decoding, which also spares every test the drafter warm-up.
"""

PLAIN_DECODING = ("speculative.mode=off", "plugins.enabled=[]")
