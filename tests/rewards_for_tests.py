"""A user reward that lives outside the library, named in configs as
`rewards_for_tests:even_length` (tests put this directory on PYTHONPATH)."""


def even_length(prompts, completions, references):
    """1 for completions of an even number of characters: an untrained policy varies on it."""
    return [float(len(c) % 2 == 0) for c in completions]
