from forgeboard.api.base import api
from forgeboard.api.configs import router as configs_router
from forgeboard.api.controller import router as controller_router
from forgeboard.api.plans import router as plans_router
from forgeboard.api.public import router as public_router
from forgeboard.api.regressions import router as regressions_router
from forgeboard.api.tokens import router as tokens_router
from forgeboard.artifacts.api import router as artifacts_router

api.add_router("/", controller_router)
api.add_router("/", public_router)
api.add_router("/", regressions_router)
api.add_router("/", configs_router)
api.add_router("/", plans_router)
api.add_router("/", tokens_router)
api.add_router("/", artifacts_router)
urlpatterns = api.urls
