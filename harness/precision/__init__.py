"""Precision: everything judged against the float64 reference (docs/precision.md).

* ``generate``      ``harness golden generate``: the reference run, its budgets, the golden written;
* ``degenerate``    a reference that says nothing (non-finite, vanishing, unbounded, flat top-k): refused;
* ``compare``       per-module metrics of a target against a golden; ``tolerance`` the defaults per dtype;
* ``signed``        the signed-error (bias) test and the golden's ``signed_error`` section;
* ``backward``      the golden's ``training`` section: gradients, optimizer, loss trajectory (training check);
* ``backward_judge``  the training check's rows against budgets, first divergent module, figures, failure;
* ``decode``        the golden's ``decode`` section: the float64 reference's cached decode (decode check);
* ``budgets``       budgets measured at golden generation (noise of a correct run in each dtype);
* ``kernels``       the kernel choices a correct backend may make, which clean measurements span (attention);
* ``align``         localize and plot errors layer by layer;
* ``isolate``       replay one module on the golden's inputs (is it this module, or its inputs?);
* ``routing``       MoE routing: captured selections, forced routing, near-tie vs fault judgement;
* ``quantization``  quantized weights' error against the reference and the budgets derived from it;
* ``runner``        the precision check's run (build, compare, generation);
* ``bisect``        the modules or ops that need higher precision or a fallback;
* ``stream``        the streamed layer-by-layer float64 reference of a full-size checkpoint;
* ``width``         decoder layers at the published widths, each module alone against float64
                    (the ``width`` check)."""
