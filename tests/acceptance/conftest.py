"""The acceptance runs share the integration fixtures (the real cluster from the root conftest.py,
Java tools, quota proxies)."""

from tests.integration.conftest import kafka_java  # noqa: F401
from tests.integration.test_quotas import quota_proxy, sasl_quota_proxy  # noqa: F401
