"""The demo's library side: a cluster of ermrun nodes on one machine (`harness`), what etcd recorded of
its run (`readers`), what the workers' progress lines say (`summary`) and prove (`checks`), and the
`erm demo` scenario phase by phase (`scenario`). `erm demo`, the closed-loop tests and the soak use it;
launcher/ only parses, wires and prints."""
