from django.contrib import admin
from django.urls import include, path

from forgeboard.api.urls import api

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", api.urls),
    path("api/agent/", include("forgeboard.cluster.urls")),
    path("", include("forgeboard.web.urls")),
]
