"""The run plan: the trigger form (:mod:`.form`), the plan of one run (:mod:`.plan` makes it; :mod:`.run_plan` types
it; :mod:`.layout` places everything of the run), every step's argv (:mod:`.argv_templates`) and its filling at run time
(:mod:`.run_requests`), the evaluation DAG's plan (:mod:`.evaluation_run`), and ``plan.json`` (:mod:`.plan_io`).

``plan`` writes the plan once (XCom, and ``plan.json`` in the run directory); every later task reads it from there.
"""
