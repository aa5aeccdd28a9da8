"""Serving engines checked against float64 (docs/serving.md).

* ``engine``  - the engines harness can drive (name, pins, runner script; the architectures are the
  engine's own unless a build narrows them), their environments under ``.harness/engines/<name>/`` and ``setup`` / ``status``;
* ``export``  - a suite's pruned, seeded model as a checkpoint an engine loads (save_pretrained),
  keeping what engine kernels dispatch on (the published head_dim);
* ``launch``  - one engine run: a request file in, a result file out, the runner script in the
  engine's own venv as a supervised process (harness.launch); an engine that says it has no code for
  the model (``EngineUnsupported``) or refuses the request (``EngineRefused``) in its own words;
* ``judge``   - the float64 transformers reference on the same checkpoint, and the verdict: prompt
  log-probabilities position by position, the greedy continuation teacher-forced.
* ``routes``  - the engine's routed experts against the float64 reference's routers, position by position
  and layer by layer, near ties within ``route_tie_margin`` a note;
* ``probes``  - the engine's own features (batching, a prefix-cache hit, chunked prefill, preemption)
  as seeded requests served in the same engine instance, each judged against float64; what the
  ``speculative`` variant's decoding drafted;
* ``verdict`` - the item's failure, the root cause first (a route, the plain run, speculation that did
  not run, a probe).

``engines/`` holds data the engine's environment uses: the pins and the standalone runner scripts
(they run in the engine's venv, which has no harness: they import nothing from it).
"""
