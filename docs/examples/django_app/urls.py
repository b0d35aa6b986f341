"""URL configuration: the scheduler's recent runs."""

from django.urls import path
from jobs.views import runs

urlpatterns = [path("runs/", runs)]
