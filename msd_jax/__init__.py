"""Modality-specific distillation (MSD, Jin et al., arXiv:2101.01881) in JAX / Flax NNX.

views      MultimodalBatch and its full / text-only / image-only views
models     single-stream multimodal transformer (teacher / student sizes) and MLP fusion model
losses     KD and MSD losses (fp32), namespaced metrics
saliency   S1 / S2 / S3 modality saliency from cross-fitted teacher predictions
weighting  uniform / population / instance / learned (bilevel) auxiliary weights, by name
step       the jitted, sharded train step and the cached-teacher forward
data       DigitsCaption, the Hateful-Memes jsonl layout, the seeded batch schedule
train      one checkpointed, resumable training run; the teacher's step; evaluation
study      teacher -> cached logits -> cross-fitted saliency -> students per method x seed
report     means, standard errors, paired comparisons, the results table and plot
"""

# Settles JAX's platform before any module here imports JAX (`jaxrl.infra.platforms`).
import jaxrl  # noqa: E402, F401
