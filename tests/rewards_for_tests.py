"""A user reward that lives outside the library, named in configs as
`rewards_for_tests:even_length` (tests put this directory on PYTHONPATH)."""


def even_length(prompts, completions, references):
    """1 for completions of an even number of characters: an untrained policy varies on it."""
    return [float(len(c) % 2 == 0) for c in completions]


def even_length_slow_generator(prompts, completions, references):
    """`even_length`, one second late on process 1 of a multi-process job (the generator of
    configs/rl/arith_tiny_roles.gin): a slow generator. On one process it is `even_length`."""
    import os
    import time

    if os.environ.get("JAXRL_PROCESS_ID") == "1":
        time.sleep(1.0)
    return even_length(prompts, completions, references)
