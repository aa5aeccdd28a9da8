"""Day-0 model inspection: what a model is and what it needs from a backend, before any weights.
(The pruning ``harness init`` chooses is ``harness.models.prune``; module kinds are ``harness.anatomy``.)

* :mod:`harness.inspect.params` - the unpruned model on the meta device: parameters total/activated,
  per module kind, checkpoint bytes per dtype (FP8 block-quantized included);
* :mod:`harness.inspect.flops` - FLOPs per token (prefill/decode) and KV-cache bytes per token;
* :mod:`harness.inspect.trace` - the aten operator inventory of one forward + backward;
* :mod:`harness.inspect.signatures` - every distinct (operator, shapes, strides, dtypes) of the unpruned
  model's forward + backward with the modules that call it, sliced only along dimensions kernels do
  not dispatch on (the ``shapes`` check);
* :mod:`harness.inspect.coverage` - that inventory classified for a backend (native, composite,
  CPU fallback, missing);
* :mod:`harness.inspect.report` - text/JSON rendering used by ``harness inspect``.
"""
