"""User reward functions (verl's ``reward.custom_reward_function.{path,name}``) and their pre-flight check.

``pkg:pipeline_steps.rewards/retool.py`` names the shipped ReTool-style example (resolved like tool configs)."""
