"""The library's RL step and generation side by side with peer libraries (Tunix, TRL).

Each side runs in a fresh process pinned to one core, the peers with their own virtual
environment's python (docs/peers.md says how to make them); all read the same HF safetensors
folder. `workload` is the only module the peer sides import from here (standard library and
NumPy only), so the prompts, rewards and summaries are the same code on every side.

    python -m bench.peers.rl_step --tunix_python /tmp/peers/tunix/bin/python \
        --trl_python /tmp/peers/trl/bin/python            # rlbench-tiny, all sides
    python -m bench.peers.rl_step --smoke                   # the library side only, seconds
    python -m bench.peers.gen --trl_python /tmp/peers/trl/bin/python --model /tmp/smol/hf
"""
