"""The etcd-v3 rendezvous: keyspace, records, the round protocol and torch's RendezvousHandler."""
