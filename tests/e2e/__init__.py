"""End-to-end tests: a real etcd, kube-apiserver, controllers and node, helm, promtool and Prometheus."""
