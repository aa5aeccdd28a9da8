"""Parallel layouts checked against the single-process reference (docs/parallel.md).

* ``layouts``  - a layout (tp, pp, dp, ep, fsdp, cp, recompute, microbatches), its name, its mesh;
* ``launcher`` - one ``torchrun`` launch per world size, time-limited, with per-rank status files;
* ``rank``     - the per-rank wrapper torchrun starts (records the worker's exit status or signal);
* ``worker``   - what one rank does for every layout of the launch;
* ``apply``    - apply_tp -> apply_ep -> apply_ac -> apply_fsdp / apply_dp, and the pipeline stages;
* ``ep``       - expert parallelism: token dispatch and combine with ``all_to_all_single``;
* ``tp_experts``- tensor parallelism inside fused experts (their 3-D weights split over tp);
* ``cp``       - context parallelism: K/V all-gathered over the cp group, a chunk-offset causal mask;
* ``memory``   - peak memory of a rank (pipeline stages by storage accounting);
* ``status``   - per-rank status files (phase, exit, signal), read by the launcher;
* ``comm``     - collectives issued, counted and sized;
* ``timing``   - step time, time inside collectives and its exposed part, one rank's step, a bandwidth probe;
* ``reference``- the single-process reference (logits, loss, gradients, weights after one step);
* ``compare``  - equivalence and localization (first diverging module, ranks, worst gradient);
* ``plan``     - ``harness plan``: feasible layouts of the full-size model, ranked.
"""
