"""The base every other package stands on: the one user-facing error, atomic files, hashes and journals
(``files``), manifests with output locks (``manifest``), stage configs and their argument checks (``config``,
``validate``), process groups (``dist``). Imports no other eyas package."""
