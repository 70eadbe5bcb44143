from forgeboard.api.base import api
from forgeboard.api.controller import router as controller_router

api.add_router("/", controller_router)
urlpatterns = api.urls
