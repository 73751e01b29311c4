"""What meets the user's run: the one-batch probe (:mod:`.numerics`), ``compare()`` (:mod:`.emulation`), the run
observers and the one assembly of a final report (:mod:`.runtime`), the crash hook (:mod:`.crash`), and what attaches
to a training run (:mod:`.training`: ``watch()``, ``mpdoctor run``).
"""
