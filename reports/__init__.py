"""Reports over the proxy's usage events (issue 14): PySpark jobs, run locally or with spark-submit.

Nothing here runs inside the proxy; pyspark is needed only by these jobs (the `spark` extra).
"""
