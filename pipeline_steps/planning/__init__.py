"""The run plan: the trigger form (:mod:`.form`), the plan of one run and the argv of every step (:mod:`.plan`).

``plan`` writes the plan once (XCom, and ``plan.json`` in the run directory); every later task reads it from there.
"""
