"""Development tooling, not the proxy runtime: a real local Kafka cluster, ZooKeeper, and the Maven fetch
that brings their jars. Tests, benchmarks and ``make run`` (with no upstream configured) use it."""
