"""Parallel layouts checked against the single-process reference (docs/parallel.md).

* ``layouts``  - a layout (tp, pp, dp, ep, fsdp, cp, recompute, microbatches), its name, its mesh;
* ``launcher`` - one ``torchrun`` launch per world size through the launch layer (``harness.launch``),
  killed on no progress, with per-rank status files;
* ``worker``   - what one rank does for every layout of the launch;
* ``apply``    - apply_tp -> apply_ep -> apply_ac -> apply_fsdp / apply_dp, and the pipeline stages;
* ``ep``       - expert parallelism: token dispatch and combine with ``all_to_all_single``;
* ``tp_experts``- tensor parallelism inside fused experts (their 3-D weights split over tp);
* ``cp``       - context parallelism: K/V all-gathered over the cp group, a chunk-offset causal mask;
* ``memory``   - peak memory of a rank (pipeline stages by storage accounting);
* ``status``   - the parallel check's per-rank status record (layout, step, collective, module);
* ``comm``     - collectives issued, counted and sized;
* ``timing``   - step time, time inside collectives and its exposed part, one rank's step, a bandwidth probe;
* ``reference``- the single-process reference (logits, loss, gradients, weights after one step);
* ``compare``  - equivalence and localization (first diverging module, ranks, worst gradient);
* ``plan``     - ``harness plan``: feasible layouts of the full-size model, ranked;
* ``rehearse`` - ``harness plan --rehearse``: the full-size model parallelized on the meta device under a
  fake process group at the real world size: divisibility, per-rank bytes, collective order.
"""
