"""Sampling on the device: the per-row columns a step samples with (columns.py), their staging
(inputs.py), the draw (sampler.py), the logits processors (processors.py), the step sampler that
applies them in an eager step and in a graph (step_sampler.py), the redraw of a replayed step's rows
(resample.py) and logprobs (logprobs.py)."""
