"""`autofuse report`: an HTML page of a dispatch table and its tuning history.

``page`` writes the folder; ``entries`` and ``history`` read the table and journal; ``html``
and ``plots`` render them.
"""
