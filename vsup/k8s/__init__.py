"""Kubernetes: vsup as the supervisor inside every pod (lws.py: a LeaderWorkerSet's group from its env;
manifests.py: what `vsup plan --k8s` prints)."""
