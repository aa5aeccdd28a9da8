"""The run machinery: suite files to pytest items and back to results.

* ``plugin``     the pytest plugin (``pytest11`` entry point): suites -> items -> JUnit properties;
* ``options``    the run's options, declared once: ``harness run``'s flags, the plugin's ``--harness-*``;
* ``execute``    one item: a check's named steps -> an ``ItemResult`` (the one mapping to outcomes);
* ``isolation``  each item in a long-lived child process with a time limit (hangs, crashes, leaks);
* ``confirm``    a failed item rerun in fresh workers: deterministic / flaky / infrastructure;
* ``exclusive``  the run lock that gives timing checks the machine alone;
* ``shard``      balanced, deterministic shards from recorded durations;
* ``schedule``   the items over a machine's xdist workers, the longest expected first (xdist's scheduler hook);
* ``durations``  the recorded item durations (time limits, shard balance);
* ``rows``       one finished item as the results keep it, outcome counts;
* ``results``    the journal and ``results/`` (junit.xml, summary.json/.txt, run.json);
* ``table``      the summary table;
* ``driver``     ``harness run``: pytest in-process with a progress bar and the table;
* ``certify``    ``harness certify``: known kernel faults on a backend's dispatch key, one ``harness run`` each;
* ``bisect``     ``harness bisect``: the first bad commit of failing items, a ``harness run`` per step;
* ``select``     ``harness select``: the suites and checks a change (a pull request's diff) can affect.
"""
