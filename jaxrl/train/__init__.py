"""The training side: the trainer that holds the policy's parameters and optimizer state on the
trainer mesh (`trainer`), its jitted steps (`steps`: log-probs, the RL and SFT losses, one
optimizer update) and their state and shardings (`state`), LoRA adapters on a frozen base
(`lora`), the SFT warm start (`sft`) and held-out evaluation (`evaluation`)."""
