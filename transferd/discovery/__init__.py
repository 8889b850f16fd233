"""Discovery: the cluster's directory of names and nodes ([discovery] url).

A name is a short string bound to a small value (an MrDesc, a NetAddr or
bytes), published through one daemon by one of its owners (a connection, a
lease or the daemon) and gone with that owner.  A node record says which
daemons are alive.  Where they live is a :class:`~transferd.discovery.backend.Backend`:
this daemon alone, in memory (``url = ""``, the default), or etcd v3
(``etcd://host:port[,...]``).

The modules: :mod:`.records` (the value types the client shares, a leaf),
:mod:`.backlog` (what waits for a watcher, on either side; a leaf too),
:mod:`.names` (the rules for names and the limits), :mod:`.directory` (the
daemon's table, owners and watchers), :mod:`.backend` (the embedded default),
:mod:`.etcd` and :mod:`.http` (etcd v3 over its JSON gateway, imported only when
an etcd url is configured), :mod:`.service` (the daemon's side: records, metrics).
Nothing here is imported by ``import client`` but :mod:`.records`, :mod:`.backlog`
and :mod:`.names`.
"""
