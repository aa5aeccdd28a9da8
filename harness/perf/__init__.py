"""Performance measurement for the ``perf`` check: samples worth comparing on noisy machines.

One module per concern:

=================  ===========================================================================
module             what
=================  ===========================================================================
``timing``         warm-up, synchronize around every timing, repeats within a time budget, GC
                   off, CPU affinity and thread count fixed and recorded
``stats``          median, IQR, bootstrap confidence interval, Mann-Whitney U (exact / normal)
``fingerprint``    the machine: backend, devices, driver, versions, CPU; its comparability class
``calibrate``      reference kernels (matmul FLOP/s per dtype, copy bandwidth), measured in the run
``roofline``       FLOPs and bytes per token from ``harness.inspect``'s formulas -> MFU / MBU
``decide``         the regression rule: past the threshold AND significant, calibrated ratio
``baseline``       samples sidecar files in the results dir; baselines under ``golden/perf/``
``workload``       the perf-sized model and its prefill / decode / train-step workloads
``profile``        operator and module times, tensor-memory peak by module; what grew on a regression
``comm``           the collective library timed on real ranks: algbw / busbw as nccl-tests defines
``commjudge``      the comm check's verdict: each collective by its samples, what gloo measured named
``measure``        the perf check's measuring steps: clock, workload, one timed phase, profile, roofline
``judge``          the perf check's judging steps: baseline comparison, re-measure, records, failure
=================  ===========================================================================
"""
