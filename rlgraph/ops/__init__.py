"""Built-in operators: the PPO/GRPO stage declarations and (with the runtime) their bodies.

`stages` declares every built-in stage (what compiling reads; it never imports a body),
`settings` their config sections as typed models (what the declarations' params are made from and
the bodies read), `names` the choices of their settings, `context` helpers over an op body's context, `models`
and `tiny` loading local models and building the examples' tiny ones. The bodies are grouped by
stage family: `rollout/` (generation), `reward/` (scoring), `train/` (actor, critic, engine),
`algos/` (the RL math and the advantage op), `data/` (prompts and built-in tasks).
"""
