"""The base every other package stands on: the one user-facing error, atomic files, hashes and journals
(``files``), manifests with output locks (``manifest``), stage configs, the arguments several stages share and
their checks (``config``, ``fields``, ``validate``), process groups (``dist``). Imports no other eyas package."""
