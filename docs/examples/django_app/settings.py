"""Minimal settings: one app, no database; the scheduler's store comes from ANARCHON_URL."""

import os

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-not-secret")
DEBUG = False
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "testserver"]
INSTALLED_APPS = ["jobs"]
ROOT_URLCONF = "urls"
USE_TZ = True

ANARCHON_URL = os.environ.get("ANARCHON_URL", "memory://")
REPORT_INTERVAL = os.environ.get("REPORT_INTERVAL", "1m")

# anarchon logs to the 'anarchon' logger: show its INFO lines on the console.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"anarchon": {"handlers": ["console"], "level": "INFO"}},
}
