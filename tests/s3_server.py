"""A real S3 API on 127.0.0.1 for the fsspec tier's s3:// tests: moto's server (``moto[server]``),
one per test session, reached by s3fs through ``storage_options: {endpoint_url: ...}``.

moto implements the S3 REST API in-process behind a real HTTP server, so s3fs, aiobotocore and
the tier's concurrency and deadlines run exactly as against a remote store. Without moto or s3fs
the tests skip, except in CI (``CI`` set), where they fail: CI installs both (the ``test`` extra).
"""
from __future__ import annotations

import logging
import os
import uuid

import pytest
from processes import free_port

#: credentials moto accepts; never real ones
FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1"}


def require_s3() -> None:
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError as e:
        if os.environ.get("CI"):
            pytest.fail(f"moto[server] or s3fs is missing but CI is set ({e}): pip install -e '.[test]'")
        pytest.skip(f"moto[server] and s3fs are needed for the s3:// tests ({e})")


@pytest.fixture(scope="session")
def s3_endpoint():
    """``http://127.0.0.1:PORT`` of a moto S3 server running for the whole session."""
    require_s3()
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # NOTE: one log line per request
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_credentials(monkeypatch):
    """moto's fake credentials in the environment, and no profile or instance metadata to find."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in FAKE_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/corekv-test-aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/corekv-test-aws-credentials")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # NOTE: else a missing key waits on IMDS


@pytest.fixture
def s3_bucket(s3_endpoint, s3_credentials):
    """A new, empty bucket on the moto server: its ``s3://`` URL."""
    import boto3

    name = f"corekv-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return f"s3://{name}"
