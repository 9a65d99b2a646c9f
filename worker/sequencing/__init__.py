"""The sequencer and its halves: what a worker does with each work message (``sequencer``),
the control messages and parked turns (``controls``), a session's erasure (``erasure``), and
the closed union of what it asks the transport to do (``actions``). No transport code."""
