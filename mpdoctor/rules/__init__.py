"""The rules: the checks, one module per concern (:mod:`.checks`; a library's own checks live in its package under
:mod:`mpdoctor.libraries`), and the engine they are built on (:mod:`.engine`: the Rule model, findings, fixes as data,
change specs and the planner).
"""
