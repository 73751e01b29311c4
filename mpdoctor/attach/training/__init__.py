"""What attaches to a training run: it watches the run, from the first step to the crash.

- :mod:`.watch`: :func:`mpdoctor.watch` for hand-written training loops (and the global loss watcher of
  ``mpdoctor run --probe-on-nan``).
- :mod:`.script_runner`: ``python -m mpdoctor run script.py``: the script's loop read first, then run unchanged, a
  mixed-precision crash explained.
- :mod:`.trainer_callback`: ``mpdoctor.MPDoctorCallback``, inside a transformers ``Trainer``; the only module
  importing transformers.
- :mod:`.lightning_callback`: ``mpdoctor.MPDoctorLightningCallback``, inside a Lightning ``Trainer.fit()``; the
  only module importing Lightning.
- :mod:`.callback_state`: the callbacks' one constructor, settings, reports and loss watcher.

Each attaches the runtime observers (:mod:`mpdoctor.attach.runtime`), probes a failing batch (:mod:`mpdoctor.attach.numerics`)
and explains a crash (:mod:`mpdoctor.attach.crash`); each removes what it attached when the run ends or raises.
Nothing is imported here, so ``import mpdoctor`` stays cheap.
"""
