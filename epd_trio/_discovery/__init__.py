"""Instances found by name: DNS names re-resolved, Kubernetes pods listed and watched.

Rule: it may import ``_core`` only (its rules are ``_core/discovery`` and ``_core/kubeconfig``);
what it finds goes to the membership, never straight into a roster.

    start     which discoverers a proxy runs, from its settings, and the checks before any worker
    dns       ``dns+``/``dnssrv+`` names re-resolved with dnspython on trio
    k8s       the pods of each role's label selector, listed then watched
    kube_api  how the API server is reached: in-cluster, a kubeconfig, or a given URL
"""
