"""The comparator: JUnit results of every shard -> classification -> one GitHub issue per group.

Read top to bottom, the pipeline is:

``junit``     read and merge the shard files (malformed input becomes a message, never a crash)
``history``   the SQLite store of earlier runs that CI carries between runs
``prefetch``  a large baseline parsed by a second process while the current run is parsed
``changepoint`` the across-runs test (a level shift that holds for at least two runs)
``classify``  failures, flakes, vanished tests, precision drift and metric regressions
``perfverdict`` the perf check's own verdicts (regression / improvement / not compared) read back
``mutes``     the mute file
``quarantine`` the quarantine file: flaky items in, re-enabled after K clean runs
``issues``    grouping, fingerprints and the plan of issue actions
``body``      the markdown of an issue (tables, first divergent module, logs; size-capped)
``scrub``     @mentions and secrets out of everything posted
``limits``    GitHub's documented size limits (comment 65,536 characters, job summary 1 MiB) and fitting to them
``sinks``     where the plan goes: GitHub (``github_client``, the only networked module), files, stdout
``errors``    what every sink raises
``triage``    whose each failure is: new in the change, main's, flaky, the runner's
``report``    the step-summary markdown and the static HTML page
``pipeline``  one run of all of the above, as ``harness compare`` does it
"""
