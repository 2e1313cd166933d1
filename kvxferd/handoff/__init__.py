"""The handoff acts: a pull checked and run (``pull``, its value ``order``), a local copy
(``local``), the decode side of a remote pull (``remote_pull``) and the offering side
(``serve``), both moving their bytes through :mod:`kvxferd.transports`; pushes (``push``) and
shared reads (``shared``). Block checksums are a service every room gets
(:mod:`kvxferd._integrity`)."""
