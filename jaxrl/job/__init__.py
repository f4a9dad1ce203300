"""What a job trains and what its workdir holds: the specs of the policy and the task that turn
into a model, tokenizer and prompt source (`specs`), and the layout of a run's directory that
every job reads alike: its config, checkpoints, adapters and logs (`workdir`)."""
