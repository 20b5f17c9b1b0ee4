# librdkafka is built from source by rdkafka-sys (make, a C/C++ compiler,
# zlib; OpenSSL for TLS and SASL SCRAM/OAUTHBEARER; libcurl for OIDC).
apt_install make g++ pkg-config zlib1g-dev libssl-dev libcurl4-openssl-dev
