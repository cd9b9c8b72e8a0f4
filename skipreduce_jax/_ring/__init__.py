"""The ring layer: who is summed, what crosses, the ring, the collectives.

``schedule`` (who is summed into which element), ``wire`` (what crosses a
hop), ``buckets``, ``shards``, ``ring`` (the one ring), ``selection``,
``traffic`` (the byte formulas), ``config`` (the settings) and
``collectives`` (the public ones). Imports nothing above it.
"""
