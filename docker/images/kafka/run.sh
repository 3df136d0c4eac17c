#!/bin/bash
# Starts a one-node KRaft Kafka (broker + controller) in the foreground, configured from the
# environment the way the official apache/kafka image is:
#
#   KAFKA_FOO_BAR=x     -> foo.bar=x      (__ -> _, ___ -> -), over the defaults below
#   CLUSTER_ID          -> the cluster id the storage is formatted with (once, on an empty disk)
#   KAFKA_HEAP_OPTS, KAFKA_OPTS   JVM options (not server properties)
#
# Shortcuts for the listeners (ignored when KAFKA_LISTENERS etc. are given):
#   KAFKA_PORT (9092)               the client listener's port
#   KAFKA_CONTROLLER_PORT (port+1)  the controller listener's port
#   KAFKA_HOST (127.0.0.1)          the address both listen on (0.0.0.0 on a bridge network)
#   KAFKA_ADVERTISED_HOST           what clients are told to connect to (default: KAFKA_HOST, or
#                                   localhost when KAFKA_HOST is 0.0.0.0)
#
# On the host network (docker run --network host) the broker then listens on
# 127.0.0.1:$KAFKA_PORT of the host, and nowhere else.
set -euo pipefail

CONFIG_DIR=/opt/kafka/config/runtime
CONFIG=$CONFIG_DIR/server.properties

port=${KAFKA_PORT:-9092}
cport=${KAFKA_CONTROLLER_PORT:-$((port + 1))}
host=${KAFKA_HOST:-127.0.0.1}
if [ "$host" = 0.0.0.0 ]; then local_host=localhost; else local_host=$host; fi
advertised=${KAFKA_ADVERTISED_HOST:-$local_host}

# Defaults: a single node whose internal topics have one replica (else transactions and
# consumer-group commits never work), no rebalance delay, a 15 min transaction timeout ceiling.
: "${KAFKA_NODE_ID:=1}"
: "${KAFKA_PROCESS_ROLES:=broker,controller}"
: "${KAFKA_LISTENERS:=PLAINTEXT://$host:$port,CONTROLLER://$host:$cport}"
: "${KAFKA_ADVERTISED_LISTENERS:=PLAINTEXT://$advertised:$port}"
: "${KAFKA_LISTENER_SECURITY_PROTOCOL_MAP:=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT}"
: "${KAFKA_CONTROLLER_LISTENER_NAMES:=CONTROLLER}"
: "${KAFKA_INTER_BROKER_LISTENER_NAME:=PLAINTEXT}"
: "${KAFKA_CONTROLLER_QUORUM_VOTERS:=$KAFKA_NODE_ID@$local_host:$cport}"
: "${KAFKA_LOG_DIRS:=/var/lib/kafka/data}"
: "${KAFKA_NUM_PARTITIONS:=1}"
: "${KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR:=1}"
: "${KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR:=1}"
: "${KAFKA_TRANSACTION_STATE_LOG_MIN_ISR:=1}"
: "${KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR:=1}"
: "${KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR:=1}"
: "${KAFKA_MIN_INSYNC_REPLICAS:=1}"
: "${KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS:=0}"
: "${KAFKA_TRANSACTION_MAX_TIMEOUT_MS:=900000}"
: "${KAFKA_NUM_NETWORK_THREADS:=2}"
: "${KAFKA_NUM_IO_THREADS:=4}"
: "${CLUSTER_ID:=ZW9zZmxvdy1rYWZrYS0wMQ}"
export "${!KAFKA_@}"

# JVM and image settings of apache/kafka's convention, and this script's own: not properties.
not_a_property=" KAFKA_HEAP_OPTS KAFKA_OPTS KAFKA_JVM_PERFORMANCE_OPTS KAFKA_GC_LOG_OPTS
  KAFKA_LOG4J_OPTS KAFKA_JMX_OPTS KAFKA_VERSION KAFKA_HOME KAFKA_PORT KAFKA_CONTROLLER_PORT
  KAFKA_HOST KAFKA_ADVERTISED_HOST KAFKA_LOG4J_ROOT_LOGLEVEL KAFKA_LOG4J_LOGGERS "

property_name() {  # KAFKA_FOO__BAR___BAZ -> foo_bar-baz
  local name=${1#KAFKA_}
  name=${name//___/\{dash\}}
  name=${name//__/\{underscore\}}
  name=${name//_/.}
  name=${name//\{dash\}/-}
  name=${name//\{underscore\}/_}
  echo "${name,,}"
}

mkdir -p "$CONFIG_DIR"
{
  echo "# written by /etc/kafka/docker/run from the environment"
  for variable in $(compgen -e | grep '^KAFKA_' | sort); do
    case "$not_a_property" in *" $variable "*) continue ;; esac
    echo "$(property_name "$variable")=${!variable}"
  done
} > "$CONFIG"

# The client listener's port, for the image's health check: the first listener that is not a
# controller listener.
for listener in ${KAFKA_LISTENERS//,/ }; do
  name=${listener%%://*}
  case ",$KAFKA_CONTROLLER_LISTENER_NAMES," in *",$name,"*) continue ;; esac
  echo "${listener##*:}" > "$CONFIG_DIR/client-port"
  break
done

CLASSPATH="/opt/kafka/libs/*"
data_dir=${KAFKA_LOG_DIRS%%,*}
if [ ! -f "$data_dir/meta.properties" ]; then
  echo "run: formatting $data_dir (cluster id $CLUSTER_ID)"
  java -Xmx256m -XX:+UseSerialGC -XX:TieredStopAtLevel=1 -cp "$CLASSPATH" \
    -Dlog4j2.configurationFile=/opt/kafka/config/tools-log4j2.yaml \
    kafka.tools.StorageTool format --ignore-formatted -t "$CLUSTER_ID" -c "$CONFIG"
fi

echo "run: starting Kafka with $CONFIG:"
grep -E '^(listeners|advertised.listeners|controller.quorum.voters)=' "$CONFIG"
# shellcheck disable=SC2086  # word splitting of the option lists is wanted
exec java ${KAFKA_HEAP_OPTS:--Xmx512m -Xms256m} -server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
  -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent -Djava.awt.headless=true \
  -Dkafka.logs.dir=/var/lib/kafka/logs -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.yaml \
  ${KAFKA_OPTS:-} -cp "$CLASSPATH" kafka.Kafka "$CONFIG"
