"""User rollout functions: verl agent loops a preset names through ``actor_rollout_ref.rollout.agent.
agent_loop_config_path`` (verl's agent-loop registration: a YAML list of ``{name, _target_, ...settings}``).

``pkg:pipeline_steps.rollouts/mcp_math_loop.yaml`` names the shipped example (resolved like tool configs and reward
files): :mod:`pipeline_steps.rollouts.mcp_math_loop`, guide 002's rollout processor (multi-turn, an MCP tool, its
own timeout and concurrency, trajectories recorded) as a verl ``AgentLoopBase``.
"""
