"""Built-in operators: the PPO/GRPO stage declarations and (with the runtime) their bodies."""
