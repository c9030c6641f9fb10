"""`autofuse tune`: search, gate, time and choose; the winner goes into the dispatch table.

Named ``tuning``, not ``tune``: ``autofuse.tune`` is the public function (``tuner.tune``), and a
subpackage of that name would replace it as the package's attribute once imported.

``tuner`` drives one key: ``search`` asks the Optuna ``study`` for configurations, ``worker``
runs each in a child process (``evaluate``: ``gate`` checks it against float64, ``timing``
times it as a ``timed_call``), ``selection`` picks the winner, and ``serve.table`` stores it.
``parallel``, ``shared_study`` and ``storage`` let several processes or machines share a study.
"""
