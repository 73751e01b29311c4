"""The front ends: ``%mpdoctor`` (:mod:`.magic`) and the command line (:mod:`.cli`, :mod:`.demo`, :mod:`.docs`).

Thin: they find the objects and call the API.
"""
