"""Google's OAuth token endpoint and GCS's bearer-token check, for the GCS emulator (fake-gcs-server has no auth).

What the real services do, as far as the store's client sees it: the client signs a JWT with the service account's
private key (google-auth, from the key file's ``private_key``) and posts it to the key file's ``token_uri``; Google
verifies the signature against the account's public key and answers an access token, or HTTP 400
``invalid_grant`` ("Invalid JWT Signature.") for a key it does not know. GCS answers 401 ``Invalid Credentials``
to a request without a token it issued. Here the token endpoint verifies with google-auth's own JWT code, and
:class:`AuthCheckingProxy` sits in front of the emulator (reached through the client library's own
``API_ENDPOINT_OVERRIDE``, so the client keeps its credentials instead of going anonymous as it does for
``STORAGE_EMULATOR_HOST``). A resumable upload's session URI is its own authorization on GCS, and here too.
"""

from __future__ import annotations

import json
import secrets
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

EMAIL = "pipeline-store@test-project.iam.gserviceaccount.com"
AUDIENCE = "https://oauth2.googleapis.com/token"  # what google-auth signs for, whatever the key's token_uri


def _pem(key) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


class GoogleAuthStandIn:
    """The token endpoint (``token_uri``) for one service account, and the tokens it issued."""

    def __init__(self):
        self._key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self._public = (
            self._key.public_key()
            .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
            .decode()
        )
        self.issued: set[str] = set()
        self.refused = 0
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                from google.auth import jwt

                form = urllib.parse.parse_qs(self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode())
                try:
                    claims = jwt.decode(form["assertion"][0], certs=stand_in._public, audience=AUDIENCE)
                    assert claims["iss"] == EMAIL
                except Exception:  # noqa: BLE001 - any bad assertion is Google's invalid_grant
                    stand_in.refused += 1
                    body, status = {"error": "invalid_grant", "error_description": "Invalid JWT Signature."}, 400
                else:
                    token = "ya29." + secrets.token_urlsafe(24)
                    stand_in.issued.add(token)
                    body, status = {"access_token": token, "expires_in": 3600, "token_type": "Bearer"}, 200
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.token_uri = f"http://127.0.0.1:{self._server.server_port}/token"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def key_file(self, *, wrong: bool = False) -> dict:
        """The service account's key file, as the Cloud console downloads it; ``wrong``: a key Google does not know
        (a deleted or rotated one) for the same account."""
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048) if wrong else self._key
        return {
            "type": "service_account",
            "project_id": "test-project",
            "private_key_id": secrets.token_hex(20),
            "private_key": _pem(key),
            "client_email": EMAIL,
            "client_id": "100000000000000000000",
            "token_uri": self.token_uri,
        }

    def authorized(self, headers) -> bool:
        auth = headers.get("Authorization") or ""
        return auth.startswith("Bearer ") and auth[len("Bearer ") :] in self.issued

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
