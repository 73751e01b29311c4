"""What mpdoctor knows about each library, one package per library: how to read its objects (``integration.py``),
its plain facts (``facts.py``), its checks (``checks.py``) and, where it has them, its callbacks and readers.

Nothing is imported here: the integrations registry (:mod:`mpdoctor.objects.integrations`) and the check registry
(:mod:`mpdoctor.rules.checks`) import each module by name.
"""
