"""The live objects: finding them (:mod:`.discovery`), reading them into facts (:mod:`.readers`, :mod:`.gathering`,
the :mod:`.integrations` registry of the libraries), the ref -> object table (:mod:`.live`) and the executable,
reversible steps that change them (:mod:`.edits`).
"""
